"""What runs beside or inside a vLLM worker: the registry announcer and the KV connector.

Nothing here is imported by the proxy. The connector and `kv.py` (its tensor work) need torch,
and the connector vLLM; everything else needs only the proxy's own dependencies, so
`pdproxy announce` runs in the proxy's image.
"""
