"""The vocabulary every layer shares (roles, ...): plain types that import nothing of pdproxy."""
