"""What things cost on this machine: timing a forward, the stored profiles, the cost model policies read."""
