-- ongrid-manager schema, version 8: why the gateway closed a connection itself. Never edit a
-- migration once released.

-- The message the user was shown when the gateway closed the connection because its key was
-- removed or expired; NULL for a connection that ended otherwise (or is still open).
ALTER TABLE connections ADD COLUMN close_reason TEXT COLLATE "C";
