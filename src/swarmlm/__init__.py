"""swarmlm: run and fine-tune large language models over a swarm of servers."""
