"""Running one model over many processes with torch.distributed: the rank layout (layout.py), the sharding rules
(sharding.py), the collectives the layers use (parallel.py), rank 0's step messages (channel.py), and starting the
ranks and their process groups (launch.py). Imports nothing from engine/ or models/."""
