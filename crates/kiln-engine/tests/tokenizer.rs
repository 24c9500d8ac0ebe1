//! Kiln's tokenizers and chat templates against references Kiln did not write: ids from Python's
//! `tokenizers` package and llama.cpp (`llama-cpp-python`), and renderings from
//! Python's `jinja2`, all made by `tests/fixtures/tokenizer/make_fixtures.py`.

use std::path::{Path, PathBuf};

use kiln_core::{Error, Result};
use kiln_engine::chat::{render, ChatMessage};
use kiln_engine::formats::GgufFile;
use kiln_engine::tokenizer::{Tokenizer, TokenizerModel, TokenizerSpec};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer").join(name)
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A spec from GGUF tokenizer metadata written as JSON (model, pre, tokens, token_type, merges,
/// bos, eos), the format of `smollm2-mini.json` and of the full SmolLM2 vocabulary.
fn spec_from_metadata_json(path: &Path) -> TokenizerSpec {
    let json = read_json(path);
    let strings = |key: &str| -> Vec<String> {
        json[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key}"))
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert_eq!(json["model"], "gpt2");
    let mut spec = TokenizerSpec::new(TokenizerModel::Gpt2, strings("tokens"));
    spec.pre = json["pre"].as_str().map(str::to_string);
    spec.merges = Some(strings("merges"));
    spec.token_types = Some(
        json["token_type"]
            .as_array()
            .unwrap_or_else(|| panic!("token_type"))
            .iter()
            .map(|v| v.as_i64().unwrap_or(-1) as i32)
            .collect(),
    );
    spec.bos_id = json["bos"].as_u64().map(|v| v as u32);
    spec.eos_id = json["eos"].as_u64().map(|v| v as u32);
    spec
}

struct Case {
    text: String,
    ids: Vec<u32>,
}

fn cases(key: &str) -> Vec<Case> {
    let json = read_json(&fixture("expected-ids.json"));
    let cases: Vec<Case> = json["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("cases"))
        .iter()
        .filter_map(|c| {
            let ids = c.get(key)?.as_array()?.iter().map(|v| v.as_u64().unwrap_or(u64::MAX) as u32).collect();
            Some(Case { text: c["text"].as_str().unwrap_or_default().to_string(), ids })
        })
        .collect();
    cases
}

fn assert_encodes_like(tokenizer: &Tokenizer, cases: &[Case], what: &str) -> Result<()> {
    assert!(cases.len() >= 20, "{what}: only {} cases", cases.len());
    for case in cases {
        let ids = tokenizer.encode(&case.text, false)?;
        assert_eq!(ids, case.ids, "{what}: {:?}", case.text);
        assert_eq!(tokenizer.decode(&ids)?, case.text, "{what}: round trip of {:?}", case.text);
        let mut stream = tokenizer.stream();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&stream.step(id)?);
        }
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, case.text, "{what}: stream of {:?}", case.text);
    }
    Ok(())
}

#[test]
fn gguf_metadata_path_matches_python_tokenizers_on_the_mini_vocabulary() -> Result<()> {
    let tokenizer = Tokenizer::from_spec(spec_from_metadata_json(&fixture("smollm2-mini.json")))?;
    assert_encodes_like(&tokenizer, &cases("mini_ids"), "mini GGUF metadata")
}

#[test]
fn tokenizer_json_path_matches_python_tokenizers_on_the_mini_vocabulary() -> Result<()> {
    let tokenizer = Tokenizer::from_file(fixture("smollm2-mini-tokenizer.json"))?;
    assert_encodes_like(&tokenizer, &cases("mini_ids"), "mini tokenizer.json")
}

#[test]
fn emoji_bytes_are_held_back_until_complete() -> Result<()> {
    let tokenizer = Tokenizer::from_spec(spec_from_metadata_json(&fixture("smollm2-mini.json")))?;
    // The mini vocabulary has no emoji tokens: 🦀 is four byte tokens.
    let ids = tokenizer.encode("🦀", false)?;
    assert_eq!(ids.len(), 4);
    let mut stream = tokenizer.stream();
    let steps: Vec<String> = ids.iter().map(|&id| stream.step(id)).collect::<Result<_>>()?;
    assert_eq!(steps, ["", "", "", "🦀"]);
    Ok(())
}

#[test]
fn special_tokens_of_the_mini_vocabulary() -> Result<()> {
    let tokenizer = Tokenizer::from_spec(spec_from_metadata_json(&fixture("smollm2-mini.json")))?;
    assert_eq!(tokenizer.encode("<|im_start|>", false)?, [1]);
    assert_eq!(tokenizer.bos_id(), Some(1));
    // EOS is <|im_end|>; <|endoftext|> also ends generation.
    assert_eq!(tokenizer.eos_ids(), [0, 2]);
    Ok(())
}

/// A GGUF file with metadata only (no tensors), written by hand for the loader's tests.
struct GgufWriter {
    kvs: Vec<u8>,
    count: u64,
}

enum Meta<'a> {
    U32(u32),
    Bool(bool),
    Str(&'a str),
    Strs(&'a [String]),
    I32s(&'a [i32]),
}

impl GgufWriter {
    fn new() -> GgufWriter {
        GgufWriter { kvs: Vec::new(), count: 0 }
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn put(&mut self, key: &str, value: Meta) -> &mut GgufWriter {
        self.count += 1;
        Self::string(&mut self.kvs, key);
        let out = &mut self.kvs;
        match value {
            Meta::U32(v) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Meta::Bool(v) => {
                out.extend_from_slice(&7u32.to_le_bytes());
                out.push(u8::from(v));
            }
            Meta::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                Self::string(out, s);
            }
            Meta::Strs(items) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                items.iter().for_each(|s| Self::string(out, s));
            }
            Meta::I32s(items) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&5u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                items.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            }
        }
        self
    }

    fn file(&self) -> Result<GgufFile> {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&self.count.to_le_bytes());
        bytes.extend_from_slice(&self.kvs);
        GgufFile::from_bytes(bytes, "test.gguf")
    }
}

fn mini_gguf(skip: &str, replace: Option<(&str, Meta)>) -> Result<GgufFile> {
    let spec = spec_from_metadata_json(&fixture("smollm2-mini.json"));
    let merges = spec.merges.clone().unwrap_or_default();
    let types = spec.token_types.clone().unwrap_or_default();
    let mut entries: Vec<(&str, Meta)> = vec![
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
        ("tokenizer.ggml.pre", Meta::Str("smollm")),
        ("tokenizer.ggml.tokens", Meta::Strs(&spec.tokens)),
        ("tokenizer.ggml.token_type", Meta::I32s(&types)),
        ("tokenizer.ggml.merges", Meta::Strs(&merges)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(2)),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(false)),
        ("tokenizer.chat_template", Meta::Str("{{ messages[0]['content'] }}")),
    ];
    entries.retain(|(k, _)| *k != skip);
    let mut writer = GgufWriter::new();
    let mut replace = replace;
    for (key, value) in entries {
        match replace.take() {
            Some((k, v)) if k == key => writer.put(key, v),
            other => {
                replace = other;
                writer.put(key, value)
            }
        };
    }
    writer.file()
}

#[test]
fn from_gguf_reads_the_metadata() -> Result<()> {
    let tokenizer = Tokenizer::from_gguf(&mini_gguf("", None)?)?;
    assert_eq!(tokenizer.chat_template(), Some("{{ messages[0]['content'] }}"));
    assert_encodes_like(&tokenizer, &cases("mini_ids"), "mini GGUF file")
}

fn tokenizer_reason(result: Result<Tokenizer>) -> String {
    match result {
        Err(Error::Tokenizer { reason }) => reason,
        Err(other) => panic!("expected Error::Tokenizer, got {other:?}"),
        Ok(_) => panic!("expected Error::Tokenizer, got a tokenizer"),
    }
}

#[test]
fn from_gguf_names_a_missing_field() -> Result<()> {
    let reason = tokenizer_reason(Tokenizer::from_gguf(&mini_gguf("tokenizer.ggml.tokens", None)?));
    assert!(reason.ends_with("metadata key `tokenizer.ggml.tokens` is missing"), "{reason}");
    let reason = tokenizer_reason(Tokenizer::from_gguf(&mini_gguf("tokenizer.ggml.merges", None)?));
    assert_eq!(reason, "a byte-level BPE vocabulary needs tokenizer.ggml.merges, which is missing");
    Ok(())
}

#[test]
fn from_gguf_names_a_wrong_type() -> Result<()> {
    let file = mini_gguf("", Some(("tokenizer.ggml.token_type", Meta::Str("normal"))))?;
    let reason = tokenizer_reason(Tokenizer::from_gguf(&file));
    assert!(
        reason.contains("metadata key `tokenizer.ggml.token_type` has type string, expected array<i32>"),
        "{reason}"
    );
    let file = mini_gguf("", Some(("tokenizer.ggml.eos_token_id", Meta::Str("2"))))?;
    let reason = tokenizer_reason(Tokenizer::from_gguf(&file));
    assert!(
        reason.contains("metadata key `tokenizer.ggml.eos_token_id` has type string, expected u32"),
        "{reason}"
    );
    Ok(())
}

#[test]
fn from_gguf_names_disagreeing_lengths() -> Result<()> {
    let types = vec![1i32; 5];
    let file = mini_gguf("", Some(("tokenizer.ggml.token_type", Meta::I32s(&types))))?;
    let reason = tokenizer_reason(Tokenizer::from_gguf(&file));
    assert!(reason.starts_with("tokenizer.ggml.token_type has 5 entries but there are "), "{reason}");
    Ok(())
}

#[test]
fn chat_templates_render_as_jinja2_does() -> Result<()> {
    let json = read_json(&fixture("chat-templates.json"));
    let bos = json["bos_token"].as_str().unwrap_or_default();
    let eos = json["eos_token"].as_str().unwrap_or_default();
    let templates = json["templates"].as_array().unwrap_or_else(|| panic!("templates"));
    assert_eq!(templates.len(), 2);
    for template in templates {
        let name = &template["name"];
        let source = template["template"].as_str().unwrap_or_default();
        for conversation in template["conversations"].as_array().unwrap_or_else(|| panic!("conversations")) {
            let messages: Vec<ChatMessage> = conversation["messages"]
                .as_array()
                .unwrap_or_else(|| panic!("messages"))
                .iter()
                .map(|m| {
                    ChatMessage::new(
                        m["role"].as_str().unwrap_or_default(),
                        m["content"].as_str().unwrap_or_default(),
                    )
                })
                .collect();
            let add = conversation["add_generation_prompt"].as_bool().unwrap_or_default();
            let rendered = render(source, &messages, add, bos, eos)?;
            assert_eq!(rendered, conversation["rendered"].as_str().unwrap_or_default(), "template {name}");
        }
    }
    Ok(())
}

fn env_path(var: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(path) => PathBuf::from(path),
        None => panic!("set {var} to run this test (see its doc comment)"),
    }
}

/// The whole SmolLM2 vocabulary (49152 tokens, 48900 merges) against Python's `tokenizers`.
/// Needs KILN_TEST_TOKENIZER_SPEC=shared/peers/smollm2-tokenizer.json (GGUF metadata as JSON).
#[test]
#[ignore = "needs KILN_TEST_TOKENIZER_SPEC (the full SmolLM2 vocabulary as JSON)"]
fn full_smollm2_vocabulary_matches_python_tokenizers() -> Result<()> {
    let tokenizer = Tokenizer::from_spec(spec_from_metadata_json(&env_path("KILN_TEST_TOKENIZER_SPEC")))?;
    assert_encodes_like(&tokenizer, &cases("full_ids"), "full vocabulary")
}

/// The tokenizer of the real SmolLM2 GGUF against Python's `tokenizers` and llama.cpp's ids; and its chat template against jinja2.
/// Needs KILN_TEST_MODEL=.models/SmolLM2-135M-Instruct.Q4_1.gguf.
#[test]
#[ignore = "needs KILN_TEST_MODEL (SmolLM2-135M-Instruct.Q4_1.gguf)"]
fn smollm2_gguf_matches_references() -> Result<()> {
    let file = GgufFile::open(env_path("KILN_TEST_MODEL"))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    assert_eq!(tokenizer.vocab_size(), 49152);
    assert_eq!(tokenizer.bos_id(), Some(1));
    assert_eq!(tokenizer.eos_ids(), [0, 2]);
    assert_encodes_like(&tokenizer, &cases("full_ids"), "SmolLM2 GGUF vs tokenizers")?;
    assert_encodes_like(&tokenizer, &cases("llama_cpp_ids"), "SmolLM2 GGUF vs llama.cpp")?;
    let json = read_json(&fixture("chat-templates.json"));
    let smollm2 = &json["templates"][0];
    assert_eq!(smollm2["name"], "smollm2");
    assert_eq!(tokenizer.chat_template(), smollm2["template"].as_str());
    let conversation = &smollm2["conversations"][0];
    let messages =
        [ChatMessage::new("user", "What is the capital of France?"), ChatMessage::new("assistant", "Paris.")];
    let rendered = kiln_engine::chat::render_with(&tokenizer, &messages, false)?;
    assert_eq!(rendered, conversation["rendered"].as_str().unwrap_or_default());
    Ok(())
}

#[test]
fn tokenizer_json_takes_template_and_special_tokens_from_the_configs_beside_it() -> Result<()> {
    let folder = std::env::temp_dir().join(format!("kiln-tokenizer-config-{}", std::process::id()));
    std::fs::create_dir_all(&folder).map_err(|e| Error::io(&folder, e))?;
    let path = folder.join("tokenizer.json");
    std::fs::copy(fixture("smollm2-mini-tokenizer.json"), &path).map_err(|e| Error::io(&path, e))?;
    let config = r#"{"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ bos_token }}"}]}"#;
    std::fs::write(folder.join("tokenizer_config.json"), config).map_err(|e| Error::io(&folder, e))?;
    std::fs::write(folder.join("generation_config.json"), r#"{"eos_token_id": [2, 5]}"#)
        .map_err(|e| Error::io(&folder, e))?;
    let tokenizer = Tokenizer::from_file(&path)?;
    assert_eq!(tokenizer.chat_template(), Some("{{ bos_token }}"));
    assert_eq!(tokenizer.bos_id(), Some(1));
    assert_eq!(tokenizer.eos_id(), Some(2));
    assert_eq!(tokenizer.eos_ids(), [0, 2, 5]);
    assert_eq!(kiln_engine::chat::render_with(&tokenizer, &[], false)?, "<|im_start|>");

    std::fs::write(folder.join("generation_config.json"), r#"{"eos_token_id": 999999}"#)
        .map_err(|e| Error::io(&folder, e))?;
    let reason = tokenizer_reason(Tokenizer::from_file(&path));
    assert!(reason.starts_with("generation_config.json: eos_token_id 999999 is out of range"), "{reason}");

    std::fs::write(&path, "{not json").map_err(|e| Error::io(&path, e))?;
    let reason = tokenizer_reason(Tokenizer::from_file(&path));
    assert!(reason.starts_with(&format!("{}: ", path.display())), "{reason}");
    std::fs::remove_dir_all(&folder).map_err(|e| Error::io(&folder, e))?;

    let missing = Tokenizer::from_file(folder.join("nowhere.json"));
    assert!(matches!(missing, Err(Error::Io { .. })), "{missing:?}");
    Ok(())
}
