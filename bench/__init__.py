"""Benchmarks side by side: pdserve against a co-located engine, transformers and raw Mooncake (`pdserve bench`)."""
