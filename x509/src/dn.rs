//! Distinguished names in the grid's slash form (OpenSSL's "oneline", as grid-mapfiles, VOMS and
//! `openssl x509 -subject -nameopt compat` print them): RDNs in certificate order,
//! `/DC=org/DC=example/OU=People/CN=Alice`, attributes by OpenSSL short name, a multi-valued RDN
//! joined with `+`, an attribute without a short name as its dotted OID. Values are written as
//! decoded text (UTF-8), not with OpenSSL's `\xHH` escapes, as the rest of ongrid always did.
//!
//! Also the structural form (a list of RDNs, each a list of (OID, value)) that the proxy name rule
//! compares, so that no rule depends on string prefixes.

use ongrid_core::Dn;
use x509_parser::x509::{AttributeTypeAndValue, X509Name};

/// Why a name could not be turned into a slash-form DN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DnError {
    #[error("the certificate is not valid DER X.509: {0}")]
    BadCertificate(String),
    #[error("the name is empty: a grid identity needs a subject DN")]
    Empty,
    #[error("the name {0:?} cannot be written in slash form")]
    NotSlashForm(String),
}

/// One attribute of an RDN: its OID in dotted form and its value as text.
pub type Attribute = (String, String);

/// A name as its RDNs, each a list of attributes, in certificate order.
pub type Rdns = Vec<Vec<Attribute>>;

/// The structural form of a name.
pub fn rdns(name: &X509Name<'_>) -> Rdns {
    name.iter_rdn()
        .map(|rdn| {
            rdn.iter()
                .map(|attribute| (attribute.attr_type().to_id_string(), value_text(attribute)))
                .collect()
        })
        .collect()
}

/// The slash form of RDNs (empty string for an empty name).
pub fn format_rdns(rdns: &[Vec<Attribute>]) -> String {
    let mut out = String::new();
    for rdn in rdns {
        out.push('/');
        for (i, (oid, value)) in rdn.iter().enumerate() {
            if i > 0 {
                out.push('+');
            }
            out.push_str(short_name(oid).unwrap_or(oid));
            out.push('=');
            out.push_str(value);
        }
    }
    out
}

/// The slash-form DN of a name.
pub fn name_to_dn(name: &X509Name<'_>) -> Result<Dn, DnError> {
    let text = format_rdns(&rdns(name));
    if text.is_empty() {
        return Err(DnError::Empty);
    }
    Dn::parse(&text).map_err(|_| DnError::NotSlashForm(text))
}

/// The slash-form DN of a name, or a readable stand-in for names that have none (for messages).
pub(crate) fn display_name(name: &X509Name<'_>) -> String {
    let text = format_rdns(&rdns(name));
    if text.is_empty() {
        "(empty name)".to_owned()
    } else {
        text
    }
}

/// The value of an attribute as text, whatever its string type.
fn value_text(attribute: &AttributeTypeAndValue<'_>) -> String {
    let any = attribute.attr_value();
    let data = any.data;
    match any.tag().0 {
        // BMPString: UTF-16 big-endian.
        30 => {
            let units: Vec<u16> = data
                .chunks(2)
                .map(|pair| u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]))
                .collect();
            String::from_utf16_lossy(&units)
        }
        // UniversalString: UTF-32 big-endian.
        28 => data
            .chunks(4)
            .map(|quad| {
                let mut bytes = [0u8; 4];
                bytes[..quad.len()].copy_from_slice(quad);
                char::from_u32(u32::from_be_bytes(bytes)).unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect(),
        // TeletexString: treated as Latin-1, as OpenSSL does.
        20 => data.iter().map(|b| char::from(*b)).collect(),
        // UTF8String, PrintableString, IA5String, VisibleString, NumericString and the rest.
        _ => String::from_utf8_lossy(data).into_owned(),
    }
}

/// OpenSSL's short name for an attribute OID (`crypto/objects/objects.txt`).
pub fn short_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.3" => "CN",
        "2.5.4.4" => "SN",
        "2.5.4.5" => "serialNumber",
        "2.5.4.6" => "C",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.9" => "street",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.12" => "title",
        "2.5.4.13" => "description",
        "2.5.4.15" => "businessCategory",
        "2.5.4.17" => "postalCode",
        "2.5.4.41" => "name",
        "2.5.4.42" => "GN",
        "2.5.4.43" => "initials",
        "2.5.4.44" => "generationQualifier",
        "2.5.4.45" => "x500UniqueIdentifier",
        "2.5.4.46" => "dnQualifier",
        "2.5.4.65" => "pseudonym",
        "2.5.4.72" => "role",
        "2.5.4.97" => "organizationIdentifier",
        "0.9.2342.19200300.100.1.1" => "UID",
        "0.9.2342.19200300.100.1.25" => "DC",
        "1.2.840.113549.1.9.1" => "emailAddress",
        "1.2.840.113549.1.9.2" => "unstructuredName",
        "1.3.6.1.4.1.311.60.2.1.1" => "jurisdictionL",
        "1.3.6.1.4.1.311.60.2.1.2" => "jurisdictionST",
        "1.3.6.1.4.1.311.60.2.1.3" => "jurisdictionC",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn attr(oid: &str, value: &str) -> Attribute {
        (oid.to_owned(), value.to_owned())
    }

    #[test]
    fn grid_names_in_certificate_order() {
        let rdns = vec![
            vec![attr("0.9.2342.19200300.100.1.25", "org")],
            vec![attr("0.9.2342.19200300.100.1.25", "example")],
            vec![attr("2.5.4.11", "People")],
            vec![attr("2.5.4.3", "Test User")],
        ];
        assert_eq!(
            format_rdns(&rdns),
            "/DC=org/DC=example/OU=People/CN=Test User"
        );
    }

    #[test]
    fn multi_valued_rdns_and_unknown_oids() {
        let rdns = vec![
            vec![attr("2.5.4.6", "DE")],
            vec![attr("2.5.4.10", "GridKa"), attr("2.5.4.11", "SCC")],
            vec![attr("1.2.3.4", "x"), attr("1.2.840.113549.1.9.1", "a@b.c")],
        ];
        assert_eq!(
            format_rdns(&rdns),
            "/C=DE/O=GridKa+OU=SCC/1.2.3.4=x+emailAddress=a@b.c"
        );
    }

    proptest! {
        // Any non-empty list of RDNs with values that do not contain '/', '+' or '=' gives one
        // component per RDN, in order, that Dn::parse accepts.
        #[test]
        fn slash_form_has_one_component_per_rdn(
            rdns in proptest::collection::vec(
                proptest::collection::vec(
                    (prop_oneof![
                        Just("2.5.4.3".to_owned()), Just("2.5.4.11".to_owned()),
                        Just("0.9.2342.19200300.100.1.25".to_owned()), Just("1.2.3.4".to_owned())
                    ], "[a-zA-Z0-9 .@-]{1,12}"),
                    1..3),
                1..6)
        ) {
            let text = format_rdns(&rdns);
            prop_assert!(Dn::parse(&text).is_ok());
            let components: Vec<&str> = text[1..].split('/').collect();
            prop_assert_eq!(components.len(), rdns.len());
            for (component, rdn) in components.iter().zip(&rdns) {
                let pieces: Vec<&str> = component.split('+').collect();
                prop_assert_eq!(pieces.len(), rdn.len());
                for (piece, (oid, value)) in pieces.iter().zip(rdn) {
                    let key = short_name(oid).unwrap_or(oid);
                    prop_assert_eq!(*piece, format!("{key}={value}"));
                }
            }
        }
    }
}
