"""Speculation: drafters for every method, n-gram indexes, draft trees, and the policy that sizes them."""
