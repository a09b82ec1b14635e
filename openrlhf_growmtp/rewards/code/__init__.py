"""Code answers: `label` is the test format, `judge` compares outputs, `sandbox` runs programs."""
