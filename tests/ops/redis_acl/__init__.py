"""ops/redis/users.acl against a real redis-server: each role can do its job and no more."""
