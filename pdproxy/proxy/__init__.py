"""The HTTP side: the ASGI app, its routes, the two legs, the upstream client."""
