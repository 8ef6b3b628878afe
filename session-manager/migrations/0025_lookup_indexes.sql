-- Indexes for lookups that scanned a whole table: a session by its owner and name, ended ones
-- included (`devctl session show NAME`, `rm`, the dashboard), which the unique index of live
-- names cannot serve; and the nodes and GPUs an admin gave an owner group, which every
-- scheduling round reads (most have none, so these indexes hold only those that do).
CREATE INDEX sessions_owner_name ON sessions(owner, name);
CREATE INDEX nodes_owned ON nodes(owner) WHERE owner IS NOT NULL;
CREATE INDEX gpus_owned ON gpus(owner) WHERE owner IS NOT NULL;
