"""Building blocks. No block knows which model it sits in; models/build.py wires them."""
