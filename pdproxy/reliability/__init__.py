"""Pure decisions about failure: what is worth retrying, how long to back off, which instances
to keep out of rotation. No sockets, no clock reads: the caller passes `now`."""
