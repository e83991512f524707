"""Serving: answers by names over HTTP on Ray Serve, from faiss indexes and shards."""
