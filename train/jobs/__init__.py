"""Jobs that chain ``draftsmith`` commands: a resumable stage runner, the quickstart's budget."""
