"""Speculative decoding: drafters propose a few tokens per sequence, one target forward verifies them all
(keeping every KDA layer's state after each token, so that the state after the last accepted token is committed
exactly), and the acceptance rule keeps the output distribution exactly the target's."""
