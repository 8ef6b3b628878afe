//! Reading a proxy file (or a certificate file): the certificates in file order (proxy first,
//! then its issuers, as grid-proxy-init and voms-proxy-init write them) and the private key.

use rustls_pemfile::Item;
use rustls_pki_types::PrivateKeyDer;

/// Why a PEM file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PemError {
    #[error(
        "the file is not valid PEM ({0}): give a proxy file (voms-proxy-init) or a PEM certificate"
    )]
    Syntax(String),
    #[error("the file holds no PEM certificate: give a proxy file (voms-proxy-init) or a PEM certificate")]
    NoCertificate,
    #[error("the file holds more than one private key: a proxy file has exactly one")]
    SeveralKeys,
}

/// The certificates (DER, in file order) and the private key, if the file has one.
pub fn read_pem_chain(
    pem: &[u8],
) -> Result<(Vec<Vec<u8>>, Option<PrivateKeyDer<'static>>), PemError> {
    let mut certs = Vec::new();
    let mut key: Option<PrivateKeyDer<'static>> = None;
    let mut rest = pem;
    loop {
        let (item, next) = match rustls_pemfile::read_one_from_slice(rest) {
            Ok(Some(found)) => found,
            Ok(None) => break,
            Err(e) => return Err(PemError::Syntax(format!("{e:?}"))),
        };
        rest = next;
        let found_key: Option<PrivateKeyDer<'static>> = match item {
            Item::X509Certificate(der) => {
                certs.push(der.as_ref().to_vec());
                None
            }
            Item::Pkcs1Key(k) => Some(k.into()),
            Item::Pkcs8Key(k) => Some(k.into()),
            Item::Sec1Key(k) => Some(k.into()),
            _ => None,
        };
        if let Some(found) = found_key {
            if key.is_some() {
                return Err(PemError::SeveralKeys);
            }
            key = Some(found);
        }
    }
    if certs.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok((certs, key))
}
