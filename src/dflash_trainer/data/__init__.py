"""Training data: records from JSONL files, loss masks from chat templates, packing into rows."""
