"""Small shared pieces used by both wings: errors, paths, atomic writes."""
