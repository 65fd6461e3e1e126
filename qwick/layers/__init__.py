"""Building blocks of the decoder models: linear, attention, rotary, norm, activation."""
