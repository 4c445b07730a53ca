"""Prefix caches: resume points and block hashes (prefix_cache), and the fleet's view of
where a prompt's blocks are (fleet)."""
