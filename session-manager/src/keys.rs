//! SSH public keys as users send them to `POST /v1/keys` and as the gateway passes them to
//! `POST /v1/gateway/authorize`: OpenSSH's one-line format parsed with the ssh-key crate (the
//! one russh re-exports), the site's policy on key types, and the SHA-256 fingerprint that names
//! a key everywhere (`SHA256:<base64>`, exactly as `ssh-keygen -l` prints it).
//!
//! [`SshPublicKey::parse_for_registration`] applies the policy and words every refusal for a
//! person; [`fingerprint_of`] only computes the fingerprint of whatever key a client offered.

use russh::keys::ssh_key::public::KeyData;
use russh::keys::{HashAlg, PublicKey};

/// The smallest RSA modulus accepted, in bits.
pub const MIN_RSA_BITS: u32 = 2048;

/// The longest text accepted: a 16384-bit RSA key is about 2.8 KB on one line.
pub const MAX_KEY_TEXT: usize = 16 * 1024;

/// A public key accepted for registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshPublicKey {
    /// `SHA256:<base64>`.
    pub fingerprint: String,
    /// `ssh-ed25519`, `ecdsa-sha2-nistp256`, `ssh-rsa`, ...
    pub algorithm: String,
    /// The comment after the key (often `user@host`); may be empty.
    pub comment: String,
    /// The key without its comment, in OpenSSH's one-line format.
    pub openssh: String,
}

/// Why a public key was refused; every message says what to send instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "the public key is empty: send the one line of your .pub file, e.g. ~/.ssh/id_ed25519.pub"
    )]
    Empty,
    #[error(
        "this is a private key, which must never leave your machine: send the public key instead \
         (the .pub file next to it, or what `ssh-keygen -y -f KEYFILE` prints)"
    )]
    PrivateKey,
    #[error(
        "this is an RFC 4716 (PuTTY) public key: convert it with `ssh-keygen -i -f FILE` and send \
         the one line it prints"
    )]
    Rfc4716,
    #[error("send one public key at a time: this text has {0} lines")]
    SeveralLines(usize),
    #[error(
        "the public key is longer than {MAX_KEY_TEXT} bytes: send the one line of your .pub file"
    )]
    TooLong,
    #[error(
        "SSH certificates ({0}) are not accepted: send the plain public key (the .pub file \
         without -cert in its name)"
    )]
    Certificate(String),
    #[error(
        "DSA keys (ssh-dss) are too weak and refused: make an Ed25519 key with \
         `ssh-keygen -t ed25519` and add its .pub file"
    )]
    Dsa,
    #[error(
        "this RSA key has {bits} bits, fewer than the {MIN_RSA_BITS} required: make an Ed25519 \
         key with `ssh-keygen -t ed25519` (or an RSA one with `-b 4096`)"
    )]
    WeakRsa { bits: u32 },
    #[error(
        "key type {0} is not supported: use ssh-ed25519, ecdsa-sha2-nistp256/384/521, a security \
         key (sk-...) or ssh-rsa of {MIN_RSA_BITS} bits or more"
    )]
    Unsupported(String),
    #[error(
        "not an OpenSSH public key ({0}): send the one line of your .pub file, like \
         `ssh-ed25519 AAAA... you@laptop`"
    )]
    Malformed(String),
}

impl SshPublicKey {
    /// Parses what a user sent and applies the site's policy: one plain public key (no private
    /// key, certificate or several lines), no DSA, RSA of at least [`MIN_RSA_BITS`].
    pub fn parse_for_registration(text: &str) -> Result<Self, KeyError> {
        if text.len() > MAX_KEY_TEXT {
            return Err(KeyError::TooLong);
        }
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(KeyError::Empty);
        }
        if trimmed.contains("PRIVATE KEY-----") {
            return Err(KeyError::PrivateKey);
        }
        if trimmed.starts_with("---- BEGIN SSH2 PUBLIC KEY ----") {
            return Err(KeyError::Rfc4716);
        }
        let lines = trimmed.lines().filter(|l| !l.trim().is_empty()).count();
        if lines > 1 {
            return Err(KeyError::SeveralLines(lines));
        }
        let kind = trimmed.split_whitespace().next().unwrap_or_default();
        if kind.ends_with("-cert-v01@openssh.com") {
            return Err(KeyError::Certificate(kind.to_owned()));
        }
        let key =
            PublicKey::from_openssh(trimmed).map_err(|e| KeyError::Malformed(e.to_string()))?;
        match key.key_data() {
            KeyData::Dsa(_) => return Err(KeyError::Dsa),
            KeyData::Rsa(rsa) if rsa.key_size() < MIN_RSA_BITS => {
                return Err(KeyError::WeakRsa {
                    bits: rsa.key_size(),
                })
            }
            KeyData::Certificate(_) => return Err(KeyError::Certificate(kind.to_owned())),
            KeyData::Other(_) => return Err(KeyError::Unsupported(kind.to_owned())),
            _ => {}
        }
        let comment = key.comment().as_str_lossy().trim().to_owned();
        let mut bare = key.clone();
        bare.set_comment("");
        let openssh = bare
            .to_openssh()
            .map_err(|e| KeyError::Malformed(e.to_string()))?
            .trim()
            .to_owned();
        Ok(Self {
            fingerprint: fingerprint(&key),
            algorithm: key.algorithm().as_str().to_owned(),
            comment,
            openssh,
        })
    }
}

/// The fingerprint of a key in OpenSSH's one-line format, whatever its type (no policy: the
/// gateway asks about keys clients offer, and an unregistered type is simply unknown).
pub fn fingerprint_of(text: &str) -> Result<String, KeyError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(KeyError::Empty);
    }
    if trimmed.len() > MAX_KEY_TEXT {
        return Err(KeyError::TooLong);
    }
    PublicKey::from_openssh(trimmed)
        .map(|key| fingerprint(&key))
        .map_err(|e| KeyError::Malformed(e.to_string()))
}

fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Made with ssh-keygen (OpenSSH 9.2); fingerprints as `ssh-keygen -l` printed them.
    const ED25519: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIs0Rx6fnjvHHuZiVBU9tDldTJLHwhaBajt5VxhThYaf a@laptop";
    const ED25519_FP: &str = "SHA256:FMdHV0bU+9XlaPjjJLAHWoiOLovS2CpdtRPnTxXxb9U";
    const ECDSA: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBE4D80FoKsrIcz9Z6BHzO7tC2vTLKUpjVybrQm9CheJBetZbULbvPzwFy10ziJ5cm67iHK/hoLv7VW5L/+CCyrM= p256@laptop";
    const ECDSA_FP: &str = "SHA256:ynvezT+yxjEoFlToVZ+Mk/HTrmRrTbvWFSfEdltJI5E";
    const RSA_3072: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABgQC2PpjaP98yiiqwvKtIaRlCODlx66Rm48xbRcOHb9ErMZGh8RqYE8JzoCNvYaPerZFXDx5x3QLZy+u8t4fD5sD1t7t0/vkZWFIVcErwNTOmjbyACGJ86MeA9cHv7ONbU99RebwVV1yhEDkvEN9bWLrm39S0j9R1qnsJcnFiMdgNYb4ZxeuLKV7ChvtwS85v4QLvZbYTouwL5wrO5z/sSoLyCPT5Tf7p+CqNXA+BTSZM1Hg/cxTr93MXQqC+BjNookgqbupakj08RQVHpSoxWl1WOeDZUqbjtNxd/rPhGf7F4oAXVqw3mttbXwk0ODZf+UFPdDUje/SnmXqpPz7wvOvhtas11QjhtPDjSmUXFn/y2ixwEDOHSGILwwG++JL9JSo/Y8nFqzChuntctyGX/TnFJ/b1qbLYsFNPYk/3eYYxJhJ0QrwML+EdU4POvKIxoRkRyRufQuc2sYjaxFTsuAbb1X8o5V66YnYAckmMJbvV6iHnRgsK+3pB2AC6hMQUM+M= r3072@laptop";
    const RSA_3072_FP: &str = "SHA256:NoyxzUEW6pujFguLnUxlbBGgUxEYtLPlUZVtegW9I1w";
    const RSA_1024: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQCxVktU6sXh8jMLYoq/PFqgOWb2soMFSzr+BIFw5bFuKooBXCKuXBF7O+Mn3x/o2wVmKIwvkqzCNCmPxuvHwfj5gOdlKj+NNYzdDyPZuejmDlWJpf6IHneNQHJhdG1/opNJthvcqjJKcbeN3mb+Gm+3pH/Fg/iyqdD8v66EUc8JbQ== r1024@laptop";
    const DSA: &str = "ssh-dss AAAAB3NzaC1kc3MAAACBAPu15W+zZ6hRcJwkqCq4J7GTZgqIVcFlum70XhBR4DxDXmcTL9O+pH4wzMO+k2ckhheJXzuKGCceMcGtFIZgIG4ggmoagAuPR4gAR0yJGlJJjRbu2ZZvWHhIr2VBawiwtx9ewxkNxiFPtot5gL1QzXHhRZrzYFUpPPbqGQUREzXxAAAAFQCY7GG3Ltxwn50cLnxfqgwhXpWayQAAAIEAqA2gJ3/nndl1+gbnIhsuUflczm2cgxzL7gt3gg63nTnlOdbLmDe1ZwIhP9SAWzTmetG/59Vck38X2jZcp1SuAHj3FTD1Xlhm5WXDoElolV5Xr5z8ZId3uAOqtg46QrrSFjpkdeepJfYLTZTHBLkQxH88nwaWbHCUluv2gxNYSc0AAACAIKLdoPGU9D4GNYLW/XeMmkpHm1sCaT8E7gYB/CKajP7nxCNaK8rNnMNCHg868dt8opmzoPk4vq4mMzdXyKkqj0IVk3kosn3lAyXR5R0wKT0zOMRnPTWX6q+EIQHEo7G+ef0+3otKdh7cYck2s2K0TEqpLZDwzsGjOInAJ3yHqhA= d@laptop";
    const CERT: &str = "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQtdjAxQG9wZW5zc2guY29tAAAAIKNLCR5H0dgwsWE+xhy4Dbqwe3r53H7lE25Oj0qduMj9AAAAIIs0Rx6fnjvHHuZiVBU9tDldTJLHwhaBajt5VxhThYafAAAAAAAAAAAAAAABAAAABHRlc3QAAAAJAAAABWFsaWNlAAAAAAAAAAD//////////wAAAAAAAACCAAAAFXBlcm1pdC1YMTEtZm9yd2FyZGluZwAAAAAAAAAXcGVybWl0LWFnZW50LWZvcndhcmRpbmcAAAAAAAAAFnBlcm1pdC1wb3J0LWZvcndhcmRpbmcAAAAAAAAACnBlcm1pdC1wdHkAAAAAAAAADnBlcm1pdC11c2VyLXJjAAAAAAAAAAAAAAAzAAAAC3NzaC1lZDI1NTE5AAAAICGWRcCmk+5eNzbpvYttr66MPmXNXj5G6XDRi4UcdtXEAAAAUwAAAAtzc2gtZWQyNTUxOQAAAED+sg1quRm4I+nsGCqJUqkIx/D1hHIZTd/Wl4jITdvKmaYO2N3YQd4h6i4RHvx2Y8bp0zmmEiLT2MHKQnginuoJ a@laptop";

    fn refused(text: &str) -> KeyError {
        SshPublicKey::parse_for_registration(text).unwrap_err()
    }

    #[test]
    fn accepted_keys_have_ssh_keygen_fingerprints() {
        let key = SshPublicKey::parse_for_registration(&format!("  {ED25519}\n")).unwrap();
        assert_eq!(key.fingerprint, ED25519_FP);
        assert_eq!(key.algorithm, "ssh-ed25519");
        assert_eq!(key.comment, "a@laptop");
        assert_eq!(
            key.openssh,
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIs0Rx6fnjvHHuZiVBU9tDldTJLHwhaBajt5VxhThYaf"
        );
        let ecdsa = SshPublicKey::parse_for_registration(ECDSA).unwrap();
        assert_eq!(ecdsa.fingerprint, ECDSA_FP);
        assert_eq!(ecdsa.algorithm, "ecdsa-sha2-nistp256");
        let rsa = SshPublicKey::parse_for_registration(RSA_3072).unwrap();
        assert_eq!(rsa.fingerprint, RSA_3072_FP);
        assert_eq!(rsa.algorithm, "ssh-rsa");
        // Without a comment, and the comment does not change the fingerprint.
        let bare = SshPublicKey::parse_for_registration(&key.openssh).unwrap();
        assert_eq!(bare.fingerprint, ED25519_FP);
        assert_eq!(bare.comment, "");
        assert_eq!(fingerprint_of(&key.openssh).unwrap(), ED25519_FP);
    }

    #[test]
    fn refusals_say_what_to_send() {
        assert_eq!(refused(" \n"), KeyError::Empty);
        let private = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAAB\n-----END OPENSSH PRIVATE KEY-----\n";
        assert_eq!(refused(private), KeyError::PrivateKey);
        assert_eq!(
            refused("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n"),
            KeyError::PrivateKey
        );
        assert!(refused(private).to_string().contains("ssh-keygen -y"));
        assert_eq!(
            refused("---- BEGIN SSH2 PUBLIC KEY ----\nAAAA\n---- END SSH2 PUBLIC KEY ----"),
            KeyError::Rfc4716
        );
        assert_eq!(
            refused(&format!("{ED25519}\n{ECDSA}\n")),
            KeyError::SeveralLines(2)
        );
        assert_eq!(
            refused(CERT),
            KeyError::Certificate("ssh-ed25519-cert-v01@openssh.com".to_owned())
        );
        assert_eq!(refused(DSA), KeyError::Dsa);
        assert_eq!(refused(RSA_1024), KeyError::WeakRsa { bits: 1024 });
        assert!(refused(RSA_1024)
            .to_string()
            .contains("ssh-keygen -t ed25519"));
        assert!(matches!(
            refused("ssh-ed25519 not-base64 x"),
            KeyError::Malformed(_)
        ));
        assert!(matches!(
            refused(&format!("restrict {ED25519}")),
            KeyError::Malformed(_)
        ));
        assert_eq!(refused(&"A".repeat(MAX_KEY_TEXT + 1)), KeyError::TooLong);
        // Refusals only apply to registration: the gateway may ask about any key.
        assert!(fingerprint_of(DSA).unwrap().starts_with("SHA256:"));
        assert!(fingerprint_of("nonsense").is_err());
    }
}
