"""The engine's two memory pools and the planner that sizes them: KDA state slots and paged MLA KV."""
