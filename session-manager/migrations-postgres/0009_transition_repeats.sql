-- ongrid-manager schema, version 9: connection flips folded in the history. Never edit a
-- migration once released.

-- How many more times this CONNECTED <-> IDLE transition happened before the one it shows (at,
-- reason: the latest). A session's SSH connections coming and going fold into its last two
-- such rows instead of adding two rows each (domain/sessions/connections.rs, `folds`), so the
-- history stays bounded; seq stays contiguous, as a folded row is always the last one.
ALTER TABLE session_transitions ADD COLUMN repeats BIGINT NOT NULL DEFAULT 0;
