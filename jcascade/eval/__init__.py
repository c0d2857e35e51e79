"""The evaluation wing: passkey retrieval, streaming perplexity, attention maps, the texts they read,
bootstrap statistics, resumable checkpoints, plots and `report` (the printed tables and JSON payloads of
every evaluation, callable from a notebook). The `jcascade` command line is a thin layer over these."""
