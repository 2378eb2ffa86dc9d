"""Cross-mesh resharding (arXiv 2211.05322): moving a tensor laid out over one device mesh to
another mesh of a different shape or layout, by send/recv, send/recv plus an all-gather inside
the destination mesh, or broadcasts with load-balanced sender choice."""
