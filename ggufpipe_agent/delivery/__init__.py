"""Stage files over the network: the sender, the receiver, the receive command,
the service a control session answers."""
