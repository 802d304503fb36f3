"""Many layers and many steps per C call: a step's layer records (layer_records), decode runs (the cache reserved
once per run: decode_run for Gemma 3's stack, program_run for layer programs) and the greedy loops' embedding / head."""
