"""The proxy's side towards the apiservers: multiplexed HTTP/2 for short GETs, pooled HTTP/1.1 for the rest, and the
HTTP/1.1 splice for upgrades; bodies stream both ways."""
