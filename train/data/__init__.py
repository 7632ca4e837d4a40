"""What training data is: record files and their one parser, chat templates and loss masks, tokenized datasets and batching, prompt sets, the EAGLE-3 draft vocabulary."""
