"""Neural-network building blocks of the Kimi K3 family: KDA, gated MLA with its indexer, latent MoE, norms."""
