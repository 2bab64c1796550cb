"""Foundations: small pieces every layer above may use, which import nothing above them."""
