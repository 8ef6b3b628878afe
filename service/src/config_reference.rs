//! Keeps `docs/config-reference.md` true: each binary's test reads the fully populated example
//! of its config file from the reference ([`toml_blocks`]) and checks it against the binary's
//! own serde struct ([`check`]): a key the reference names that the struct does not know fails
//! (the structs deny unknown fields), and so does a key of the struct that the example leaves
//! out.
//!
//! The second check needs the struct's field names, which serde only tells the deserializer:
//! [`check`] deserializes the example through [`Traced`], a deserializer over the parsed TOML
//! that records, for every struct serde asks it for, the fields the struct has and the keys the
//! table holds. Structs reached only through an internally tagged enum (the agent's `[gpu]`)
//! are deserialized by serde from its own buffer, out of sight; their unknown keys are still
//! refused.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt;

use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};

/// The bodies of the fenced blocks of `markdown` whose info string is `toml <name>`, in order.
pub fn toml_blocks(markdown: &str, name: &str) -> Vec<String> {
    let fence = format!("```toml {name}");
    let mut blocks = Vec::new();
    let mut lines = markdown.lines();
    while let Some(line) = lines.next() {
        if line.trim_end() == fence {
            let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
            blocks.push(body.join("\n"));
        }
    }
    blocks
}

/// What [`check`] found wrong with an example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// The example is not TOML, or `T` refused it (an unknown key names itself here).
    Refused(String),
    /// Keys of `T` (dotted paths, `[[array]]` entries as `name[]`) the example leaves out.
    Missing(Vec<String>),
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(why) => write!(f, "the config struct refuses the example: {why}"),
            Self::Missing(keys) => write!(
                f,
                "the example leaves out these keys of the config struct: {}",
                keys.join(", ")
            ),
        }
    }
}

/// Deserializes `example` into `T`, and fails unless every key of every struct reached has a
/// value in it.
pub fn check<T: DeserializeOwned>(example: &str) -> Result<T, Mismatch> {
    let value: toml::Value =
        toml::from_str(example).map_err(|e| Mismatch::Refused(e.to_string()))?;
    let keys = RefCell::new(Keys::default());
    let parsed = T::deserialize(Traced {
        value,
        path: String::new(),
        keys: &keys,
    })
    .map_err(|e| Mismatch::Refused(e.to_string()))?;
    let keys = keys.into_inner();
    let missing: Vec<String> = keys.asked.difference(&keys.given).cloned().collect();
    if missing.is_empty() {
        Ok(parsed)
    } else {
        Err(Mismatch::Missing(missing))
    }
}

type Error = de::value::Error;

/// The fields of the structs deserialized, and those the example gave a value, as dotted
/// paths; the entries of an array share one path (`name[]`), so a field counts as given when
/// one entry has it.
#[derive(Debug, Default)]
struct Keys {
    asked: BTreeSet<String>,
    given: BTreeSet<String>,
}

/// A TOML value that records the struct fields it is asked for and those it has.
struct Traced<'a> {
    value: toml::Value,
    /// Dotted, from the file's top.
    path: String,
    keys: &'a RefCell<Keys>,
}

/// `parent.key`, or `key` at the top.
fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

impl<'de, 'a> de::Deserializer<'de> for Traced<'a> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.value {
            toml::Value::String(s) => visitor.visit_string(s),
            toml::Value::Integer(i) => visitor.visit_i64(i),
            toml::Value::Float(f) => visitor.visit_f64(f),
            toml::Value::Boolean(b) => visitor.visit_bool(b),
            toml::Value::Datetime(d) => visitor.visit_string(d.to_string()),
            toml::Value::Array(items) => {
                let path = format!("{}[]", self.path);
                visitor.visit_seq(de::value::SeqDeserializer::new(items.into_iter().map(
                    |item| Traced {
                        value: item,
                        path: path.clone(),
                        keys: self.keys,
                    },
                )))
            }
            toml::Value::Table(table) => {
                let entries: Vec<(String, Traced<'a>)> = table
                    .into_iter()
                    .map(|(key, value)| {
                        let child = Traced {
                            value,
                            path: join(&self.path, &key),
                            keys: self.keys,
                        };
                        (key, child)
                    })
                    .collect();
                visitor.visit_map(de::value::MapDeserializer::new(entries.into_iter()))
            }
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        // TOML has no null: a key that is there is `Some`.
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        if let toml::Value::Table(table) = &self.value {
            let mut keys = self.keys.borrow_mut();
            for field in fields {
                let path = join(&self.path, field);
                if table.contains_key(*field) {
                    keys.given.insert(path.clone());
                }
                keys.asked.insert(path);
            }
        }
        self.deserialize_any(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match self.value {
            toml::Value::String(variant) => visitor.visit_enum(variant.into_deserializer()),
            other => Err(de::Error::custom(format!(
                "{}: an enum written as {} is not supported here",
                self.path,
                other.type_str()
            ))),
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct seq tuple tuple_struct map identifier ignored_any
    }
}

impl<'de, 'a> IntoDeserializer<'de, Error> for Traced<'a> {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct File {
        listen: String,
        #[serde(default)]
        port: Option<u16>,
        #[serde(default)]
        limits: Limits,
        #[serde(default)]
        groups: BTreeMap<String, Limits>,
        #[serde(default)]
        mounts: Vec<Mount>,
        #[serde(default)]
        mode: Option<Mode>,
    }

    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Limits {
        max: Option<u32>,
        ratio: Option<f64>,
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Mount {
        source: String,
        target: Option<String>,
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(rename_all = "lowercase")]
    enum Mode {
        Fast,
    }

    const FULL: &str = "listen = \"x\"\nport = 22\nmode = \"fast\"\n\
        [limits]\nmax = 1\nratio = 0.5\n[groups.atlas]\nmax = 2\nratio = 1.0\n\
        [[mounts]]\nsource = \"/a\"\ntarget = \"/b\"\n";

    #[test]
    fn a_full_example_passes_and_deserializes_as_toml_would() {
        let traced: File = check(FULL).unwrap();
        assert_eq!(traced, toml::from_str::<File>(FULL).unwrap());
        assert_eq!(traced.groups["atlas"].max, Some(2));
    }

    #[test]
    fn a_key_left_out_is_named_with_its_path() {
        let text = FULL
            .replace("port = 22\n", "")
            .replace("ratio = 1.0\n", "")
            .replace("target = \"/b\"\n", "");
        assert_eq!(
            check::<File>(&text).unwrap_err(),
            Mismatch::Missing(vec![
                "groups.atlas.ratio".into(),
                "mounts[].target".into(),
                "port".into()
            ])
        );
    }

    #[test]
    fn a_key_counts_when_one_entry_of_an_array_has_it() {
        let text = FULL.replace(
            "target = \"/b\"\n",
            "[[mounts]]\nsource = \"/c\"\n[[mounts]]\nsource = \"/d\"\ntarget = \"/e\"\n",
        );
        let parsed: File = check(&text).unwrap();
        assert_eq!(parsed.mounts.len(), 3);
    }

    #[test]
    fn a_key_the_struct_does_not_know_is_refused() {
        let err = check::<File>(&format!("{FULL}[limits2]\nmax = 1\n")).unwrap_err();
        let Mismatch::Refused(why) = err else {
            panic!("{err:?}")
        };
        assert!(why.contains("limits2"), "{why}");
        let err = check::<File>(&FULL.replace("ratio = 0.5", "ration = 0.5")).unwrap_err();
        assert!(err.to_string().contains("ration"), "{err}");
    }

    #[test]
    fn blocks_are_found_by_name() {
        let markdown =
            "# x\n```toml a\nk = 1\n```\ntext\n```toml b\nj = 2\n```\n```toml a\nm = 3\n```\n";
        assert_eq!(toml_blocks(markdown, "a"), ["k = 1", "m = 3"]);
        assert_eq!(toml_blocks(markdown, "b"), ["j = 2"]);
        assert!(toml_blocks(markdown, "c").is_empty());
    }
}
