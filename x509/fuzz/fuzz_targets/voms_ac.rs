//! Fuzzes the VOMS attribute-certificate parser with arbitrary extension values, and the FQAN
//! parser with whatever FQAN strings come out.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ongrid_x509::voms::{self, Fqan};

fuzz_target!(|data: &[u8]| {
    if let Ok(acs) = voms::parse_ac_extension(data) {
        for ac in acs {
            for text in &ac.fqans {
                if let Ok(fqan) = Fqan::parse(text) {
                    // Display is a parseable fixed point.
                    let shown = fqan.to_string();
                    assert_eq!(Fqan::parse(&shown).ok(), Some(fqan));
                }
            }
        }
    }
});
