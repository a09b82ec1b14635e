"""openrlhf-growmtp: OpenRLHF runs that grow their own speculative-decoding draft head (GrowMTP)."""

__version__ = "0.1.0"
