"""The drafter kinds, each implementing the Drafter protocol of specloop.drafter.decode.proposer: pretrained
LMs, SD² steered LMs, DVI LoRA heads, EAGLE-style heads, suffix decoding, n-gram, and a mix of them; the
table of kinds (table.py) says how each is built, trained and logged."""
