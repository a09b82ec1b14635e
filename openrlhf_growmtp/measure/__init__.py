"""Speed figures that survive a second look: paired measurements, their intervals, and kept files with their
provenance (docs/measurements.md, "How speed is measured")."""
