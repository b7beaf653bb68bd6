"""The model: a Gemma-style decoder (`transformer`), its mixture-of-experts MLP (`moe`), named
sizes (`presets`), its configuration (`config`) and the logical-axis sharding rules (`sharding`)."""
