//! Signature checks with ring, and key sizes. The algorithm mapping is ours so that the minimum
//! RSA size is ongrid's policy (`VerifyOptions::min_rsa_bits`) and not ring's fixed 2048 bits:
//! SHA-1 signatures are refused, RSA keys of any size ring can handle are checked, and the size
//! rule is applied to every key separately with a message that says what to do.

use ring::signature::{self, UnparsedPublicKey, VerificationAlgorithm};
use x509_parser::public_key::PublicKey;
use x509_parser::x509::SubjectPublicKeyInfo;

const RSA_ENCRYPTION: &str = "1.2.840.113549.1.1.1";
const SHA1_WITH_RSA: &str = "1.2.840.113549.1.1.5";
const SHA256_WITH_RSA: &str = "1.2.840.113549.1.1.11";
const SHA384_WITH_RSA: &str = "1.2.840.113549.1.1.12";
const SHA512_WITH_RSA: &str = "1.2.840.113549.1.1.13";
const ECDSA_WITH_SHA256: &str = "1.2.840.10045.4.3.2";
const ECDSA_WITH_SHA384: &str = "1.2.840.10045.4.3.3";
const ED25519: &str = "1.3.101.112";
const CURVE_P256: &str = "1.2.840.10045.3.1.7";
const CURVE_P384: &str = "1.3.132.0.34";

/// Why a signature did not verify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SigError {
    /// The algorithm (dotted OID) is not one ongrid accepts.
    Unsupported(String),
    /// The signature does not match the data and key.
    Invalid,
}

/// Checks `signature` over `data` by the key in `spki`, for the signature algorithm `alg_oid`.
pub(crate) fn verify(
    spki: &SubjectPublicKeyInfo<'_>,
    alg_oid: &str,
    signature: &[u8],
    data: &[u8],
) -> Result<(), SigError> {
    let unsupported = || SigError::Unsupported(alg_oid.to_owned());
    let algorithm: &'static dyn VerificationAlgorithm = match alg_oid {
        // The key size is checked by policy (min_rsa_bits) before any signature.
        SHA256_WITH_RSA => &signature::RSA_PKCS1_1024_8192_SHA256_FOR_LEGACY_USE_ONLY,
        SHA384_WITH_RSA => &signature::RSA_PKCS1_2048_8192_SHA384,
        SHA512_WITH_RSA => &signature::RSA_PKCS1_1024_8192_SHA512_FOR_LEGACY_USE_ONLY,
        ECDSA_WITH_SHA256 | ECDSA_WITH_SHA384 => {
            let curve = spki
                .algorithm
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok())
                .map(|oid| oid.to_id_string())
                .ok_or_else(unsupported)?;
            match (curve.as_str(), alg_oid) {
                (CURVE_P256, ECDSA_WITH_SHA256) => &signature::ECDSA_P256_SHA256_ASN1,
                (CURVE_P256, _) => &signature::ECDSA_P256_SHA384_ASN1,
                (CURVE_P384, ECDSA_WITH_SHA256) => &signature::ECDSA_P384_SHA256_ASN1,
                (CURVE_P384, _) => &signature::ECDSA_P384_SHA384_ASN1,
                _ => return Err(unsupported()),
            }
        }
        ED25519 => &signature::ED25519,
        _ => return Err(unsupported()),
    };
    UnparsedPublicKey::new(algorithm, &spki.subject_public_key.data)
        .verify(data, signature)
        .map_err(|_| SigError::Invalid)
}

/// Whether `alg_oid` is SHA-1 with RSA (named separately in messages).
pub(crate) fn is_sha1(alg_oid: &str) -> bool {
    alg_oid == SHA1_WITH_RSA || alg_oid == "1.3.14.3.2.29"
}

/// The size in bits of an RSA key, `None` for other key types.
pub(crate) fn rsa_bits(spki: &SubjectPublicKeyInfo<'_>) -> Option<u32> {
    if spki.algorithm.algorithm.to_id_string() != RSA_ENCRYPTION {
        return None;
    }
    let Ok(PublicKey::RSA(rsa)) = spki.parsed() else {
        // An RSA key we cannot read counts as no key at all.
        return Some(0);
    };
    let modulus = crate::der::strip_leading_zeros(rsa.modulus);
    let Some(first) = modulus.first() else {
        return Some(0);
    };
    let bits = 8 * modulus.len() as u64 - u64::from(first.leading_zeros());
    Some(u32::try_from(bits).unwrap_or(u32::MAX))
}
