//! OpenAPI schema of [`AgentEvent`]: a `oneOf` of one named component per variant, with a
//! discriminator on `type`. utoipa derives nothing like it for an internally tagged enum
//! flattened into an envelope, so the components are assembled here from the payloads' derived
//! schemas.

use utoipa::ToSchema;
use utoipa::openapi::schema::{Discriminator, Object, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::openapi::{KnownFormat, RefOr, SchemaFormat};

use super::{AgentEvent, variant_schemas};

/// One variant's schema parts, taken from its payload type.
pub(crate) struct VariantSchema {
    pub(super) tag: &'static str,
    component: &'static str,
    payload: RefOr<Schema>,
    nested: Vec<(String, RefOr<Schema>)>,
}

impl VariantSchema {
    pub(crate) fn of<P: ToSchema>(tag: &'static str, component: &'static str) -> Self {
        let mut nested = Vec::new();
        P::schemas(&mut nested);
        Self {
            tag,
            component,
            payload: P::schema(),
            nested,
        }
    }

    /// The variant's component: envelope fields, the one-value `type` enum, then the payload's.
    fn component_schema(self) -> Schema {
        let mut object = envelope();
        object.properties.insert(
            "type".to_owned(),
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some([self.tag]))
                .description(Some("The variant's tag; also the SSE `event:` name."))
                .into(),
        );
        object.required.push("type".to_owned());
        if let RefOr::T(Schema::Object(payload)) = self.payload {
            object.description = payload.description;
            for (name, property) in payload.properties {
                object.properties.insert(name, property);
            }
            object.required.extend(payload.required);
        }
        Schema::Object(object)
    }
}

fn envelope() -> Object {
    let string = |description: &str| -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description))
            .into()
    };
    let formatted = |format: KnownFormat, description: &str| -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(format)))
            .description(Some(description))
            .into()
    };
    let mut object = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property(
            "sequence",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                .minimum(Some(1))
                .description(Some("Per-run position, contiguous from 1; the SSE `id:`.")),
        )
        .property(
            "run_id",
            formatted(KnownFormat::Uuid, "The run the event belongs to."),
        )
        .property(
            "timestamp",
            formatted(
                KnownFormat::DateTime,
                "When the event was emitted (RFC 3339, UTC).",
            ),
        )
        .property(
            "trace_id",
            string("W3C trace context trace id (32 hex chars), empty when unavailable."),
        )
        .property(
            "span_id",
            string("W3C trace context span id (16 hex chars), empty when unavailable."),
        )
        .build();
    object.required = ["sequence", "run_id", "timestamp", "trace_id", "span_id"]
        .map(str::to_owned)
        .to_vec();
    object
}

impl utoipa::PartialSchema for AgentEvent {
    fn schema() -> RefOr<Schema> {
        let mut one_of = OneOfBuilder::new().description(Some(
            "One event of a run's log: the envelope plus one payload variant, tagged by `type`.",
        ));
        let mut discriminator = Discriminator::new("type");
        for variant in variant_schemas() {
            let reference = format!("#/components/schemas/{}", variant.component);
            discriminator
                .mapping
                .insert(variant.tag.to_owned(), reference.clone());
            one_of = one_of.item(RefOr::Ref(utoipa::openapi::Ref::new(reference)));
        }
        one_of.discriminator(Some(discriminator)).into()
    }
}

impl ToSchema for AgentEvent {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        for variant in variant_schemas() {
            schemas.extend(variant.nested.iter().cloned());
            let name = variant.component.to_owned();
            schemas.push((name, RefOr::T(variant.component_schema())));
        }
    }
}
