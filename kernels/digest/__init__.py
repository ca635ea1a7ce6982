"""SHA-256 of many fixed-size blocks on a GPU at once (the weights digest's per-block hashes)."""
