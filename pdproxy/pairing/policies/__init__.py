"""Selection policies: one file per policy, all behind the `Policy` protocol."""
