"""The drafters that grow a tree (draft model, feature head, context, PEARL), its policies, a loaded pair."""
