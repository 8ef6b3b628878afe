-- The VOMS attributes (FQANs) of the credential each SSH key was last registered with, so the
-- gateway's login re-checks the site's [policy] admission on what the key's owner showed: a JSON
-- array of FQAN strings; NULL for keys registered before this migration (checked as showing
-- none, so a user admitted by VO registers the key again with a VOMS proxy). Port of the SQLite
-- migration of the same name.
ALTER TABLE ssh_keys ADD COLUMN fqans TEXT COLLATE "C";
