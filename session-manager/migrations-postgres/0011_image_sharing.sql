-- ongrid-manager schema, version 11: shared images. Never edit a migration once released.
-- Times are RFC 3339 UTC text with nanoseconds, as in 0001.

-- shared_at: when the owner shared the image (`devctl image share`); NULL while it is private.
-- A shared image may be run by any user, by `<owner login>/<name>:<version>` or by digest.
ALTER TABLE images ADD COLUMN shared_at TEXT COLLATE "C";
CREATE INDEX images_shared ON images(shared_at) WHERE shared_at IS NOT NULL;
