"""Prefix caches: resume points and block hashes (prefix_cache). What the tables keep of
each worker's cache and each sequence's prompt; imports nothing of the tables."""
