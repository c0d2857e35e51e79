"""The evaluation wing: passkey retrieval (`passkey`), streaming perplexity (`perplexity`), attention maps
(`attention_map`), whether a policy compresses with or without the question (`protocol`), the texts they read (`texts`),
bootstrap intervals that cannot overclaim (`stats`), resumable checkpoints (`checkpointing`), reports (`report`: the
JSON payloads and printed tables), figures (`plots`), the loop the command line runs them in (`runner`) and the main
job's settings (`main_job`). The `jcascade` command line is a thin layer over these."""
