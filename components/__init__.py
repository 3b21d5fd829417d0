"""retro-realm components: the ML library (data, models, index, training, eval). No Prefect imports here."""
