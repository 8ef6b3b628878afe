//! Creates that may be sent twice. A client that lost the answer to a create (the manager it
//! asked went away before answering) sends the same request again with the same
//! `Idempotency-Key`, to the same or to another replica. The record such a request creates
//! gets an id derived from the caller and the key ([`derived_id`]), so the second request finds
//! the first one's record and answers with it instead of making a second session or job. Pure:
//! the use cases look the id up.

use ongrid_core::Dn;

/// The request header, as devctl sends it.
pub const HEADER: &str = "idempotency-key";

/// A client's key for one request: 1 to 64 ASCII letters, digits, `-` and `_` (devctl sends a
/// UUID).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(text: &str) -> Result<Self, String> {
        let valid = !text.is_empty()
            && text.len() <= 64
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if valid {
            Ok(Self(text.to_owned()))
        } else {
            Err(format!(
                "the {HEADER} header must be 1 to 64 letters, digits, '-' or '_' (a UUID), \
                 not {text:?}"
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The id of the `kind` record (`session`, `job`) that `owner`'s request `key` creates: the
/// first 16 bytes of SHA-256 of `ongrid <kind> request of <owner> with key <key>`, as a version-8
/// UUID. Another owner's same key gives another id.
pub fn derived_id(kind: &str, owner: &Dn, key: &IdempotencyKey) -> uuid::Uuid {
    sha256_uuid(&format!(
        "ongrid {kind} request of {owner} with key {}",
        key.as_str()
    ))
}

/// The first 16 bytes of SHA-256 of `text` as a version-8 (custom) UUID.
pub fn sha256_uuid(text: &str) -> uuid::Uuid {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(text.as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bytes[6] = (bytes[6] & 0x0f) | 0x80;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    uuid::Uuid::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_short_tokens() {
        let uuid = "5f1c2d0e-8a7b-4c3d-9e8f-0a1b2c3d4e5f";
        assert_eq!(IdempotencyKey::parse(uuid).unwrap().as_str(), uuid);
        for bad in ["", "a b", "é", "x\ny", &"k".repeat(65)] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_same_owner_and_key_give_the_same_id_and_nothing_else_does() {
        let alice = Dn::parse("/DC=org/CN=Alice").unwrap();
        let bob = Dn::parse("/DC=org/CN=Bob").unwrap();
        let key = IdempotencyKey::parse("k1").unwrap();
        let other = IdempotencyKey::parse("k2").unwrap();
        let id = derived_id("session", &alice, &key);
        assert_eq!(id, derived_id("session", &alice, &key));
        assert_eq!(id.get_version_num(), 8);
        assert_ne!(id, derived_id("session", &bob, &key));
        assert_ne!(id, derived_id("session", &alice, &other));
        assert_ne!(id, derived_id("job", &alice, &key));
    }
}
