"""The evaluation wing: passkey retrieval (`passkey`), RULER's synthetic tasks (`ruler`), streaming perplexity
(`perplexity`), attention maps (`attention_map`), whether a policy compresses with or without the question
(`protocol`), the texts they read (`texts`), bootstrap intervals that cannot overclaim (`stats`), resumable
checkpoints (`checkpointing`), reports (`report`: the JSON payloads and printed tables), figures (`plots`), the loop
the command line runs them in (`runner`), rows over processes of one device each (`processes`) and the main job's
settings (`main_job`). The `jcascade` command line (`jcascade.cli`) is a thin layer over these."""
