"""The swarm as data: DHT nodes and records, server identities and private swarms, routing over announced spans."""
