"""Model building blocks: linear (delegating to a quant method), attention, rotary, norm."""
