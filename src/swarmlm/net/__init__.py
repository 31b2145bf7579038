"""The network layer shared by clients, servers and the API: streams and frames over p2pd, dialing, the bounded
rpc_info call, the server's stream transport and the patches to hivemind's P2P they need."""
