"""Request surfaces: one adapter per request format, each knowing where media sits in its bodies."""
