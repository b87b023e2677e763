"""Who is in the run: the registry of peer records, the run spec in the DHT, which
stage a joiner takes, whether others can reach us, and staying connected."""
